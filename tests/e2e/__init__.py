"""Browser (end-to-end) tests. A package, so that its conftest and helpers never shadow the
`conftest` module that tests/ imports helpers from."""
