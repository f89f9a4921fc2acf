from tests.services.common.conftest import redis_url  # noqa: F401  (a fixture shared with the registry tests)
