"""What tests share and are not tests themselves: fixtures' builders, fakes, servers and drivers.

Imported as `helpers.<module>` (pytest puts `tests/` on `sys.path`: `tests/conftest.py` sits there and
`tests/` is no package). tests/README.md lists each module and what it is for.
"""
