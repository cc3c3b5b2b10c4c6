"""Side-by-side measurements of Warsha against its peers; each module runs as ``python -m benchmarks.<name>``.

Benchmarks import the product like any user and print a table and write JSON under
``benchmarks/results/``. What decides a reported figure lives in the product, where it is tested;
tests never import this package.
"""
