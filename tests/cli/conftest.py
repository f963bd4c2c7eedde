from tests.isolation import specdec_home  # noqa: F401  (autouse)
