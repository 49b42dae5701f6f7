"""What the tests share: harnesses, fakes and canned inputs, imported as `support.<module>` (pytest puts tests/ on
sys.path: `pythonpath` in pyproject.toml).

Test modules never import one another (tests/unit/test_test_tree.py checks): what two of them need lives here,
and a fixture two of them use lives in the conftest.py of the folder they share.
"""
