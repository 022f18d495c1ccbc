"""The failures the plugin repairs, one per fix, named once.

``--help``, the package docstring, ``doctor``, ``setup.py``'s description (which reads this file
without importing the package, so it holds literals only) and README.md say these words; a test
holds them to it.
"""

FAILURES = {
    "dtype": "mixed parameter dtypes in one group",
    "recompute": "activation-checkpoint recompute",
    "reduce": "gradient reduction in reduce_dtype",
}
HEADLINE = "three FSDP2 (fully_shard) mixed-precision failures"
