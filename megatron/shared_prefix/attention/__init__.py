"""Tree attention: each token attends causally in its segment and fully to its ancestor segments.

Backends share one mask, ``k <= q < token_subtree_end[k]`` (see ForestTensors): ``torch_backend``
runs everywhere and is the oracle of the fast paths; ``reference`` holds dense-mask oracles for
tests.
"""
