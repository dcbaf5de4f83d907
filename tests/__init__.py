"""The test suite, one folder per source folder (heads/, decoding/, training/, the package root
draftheads/ as cli/, scripts/) plus properties/ for what holds end to end. A package tree, so
modules of the same name in two folders do not collide; ``helpers`` is importable by name
because pyproject's ``pythonpath`` puts tests/ on the path."""
