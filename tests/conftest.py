import pytest

from provider_server import ProviderServer


@pytest.fixture
def provider_server():
    with ProviderServer() as server:
        yield server
