"""The service's settings (sltune.settings)."""


def test_an_empty_api_token_is_no_token():
    from sltune.settings import Settings

    assert Settings(api_token="").api_token is None
