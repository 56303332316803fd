import openai
import pytest

from tests.platform.live_stack import live_stack  # noqa: F401  (the shared session-scoped live stack)


@pytest.fixture
def client(live_stack):  # noqa: F811
    return openai.OpenAI(base_url=live_stack.base_url + "/v1", api_key=live_stack.api_key, max_retries=0, timeout=120)
