"""In-memory stand-ins for the services' repositories: the handler unit tests run on them, and the repository
contract tests (tests/integration/test_*_repository_contract.py) hold each to its Postgres adapter's answers."""
