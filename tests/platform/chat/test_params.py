"""The playground's parameter panel: it starts from the served model's defaults, says which came
from the model, and sends every value it shows to the engine."""

import json

import pytest
from django.urls import reverse
from tiny_models import make_tiny_model

from chat import params as chat_params
from inference.gguf_files import bundled_model
from inference.sampling_params import SamplingParams

pytestmark = pytest.mark.django_db


@pytest.fixture
def model_with_defaults(tmp_path, settings):
    folder = make_tiny_model(tmp_path / "tiny", "llama")
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_k": 40, "do_sample": True}))
    settings.MODEL = str(folder)
    return folder


def test_smollm2_sets_no_defaults_so_the_playground_ones_apply(settings):
    settings.MODEL = str(bundled_model())
    assert chat_params.defaults() == chat_params.PLAYGROUND_DEFAULTS
    assert set(chat_params.default_sources().values()) == {"playground"}


def test_the_models_generation_config_comes_first_and_is_labelled(model_with_defaults):
    start = chat_params.defaults()
    assert (start["temperature"], start["top_k"]) == (0.6, 40)
    assert start["repetition_penalty"] == chat_params.PLAYGROUND_DEFAULTS["repetition_penalty"]
    assert chat_params.default_sources() == {
        "temperature": "model",
        "top_k": "model",
        "top_p": "playground",
        "repetition_penalty": "playground",
    }
    assert chat_params.clean({})["temperature"] == 0.6  # a panel value left out starts from the model's


def test_every_panel_value_reaches_the_engine_and_is_valid_there():
    cleaned = chat_params.clean({"temperature": "0.4", "top_k": "12", "repetition_penalty": 1.3, "seed": 7})
    sp = chat_params.sampling_params(cleaned)
    assert (sp["temperature"], sp["top_k"], sp["repetition_penalty"], sp["seed"]) == (0.4, 12, 1.3, 7)
    engine_params = SamplingParams(**sp)
    assert not engine_params.model_default_fields - {"min_p"}  # nothing the panel shows is left to the model
    with pytest.raises(chat_params.InvalidParams, match="repetition_penalty"):
        chat_params.clean({"repetition_penalty": 3})
    with pytest.raises(chat_params.InvalidParams, match="top_k"):
        chat_params.clean({"top_k": -1})


def test_the_playground_page_carries_the_defaults_and_their_sources(client, make_user, model_with_defaults):
    client.force_login(make_user())
    html = client.get(reverse("chat:playground")).content.decode()
    state = json.loads(html.split('id="playground-state" type="application/json">', 1)[1].split("</script>", 1)[0])
    assert state["params"]["temperature"] == 0.6 and state["param_sources"]["temperature"] == "model"
    assert state["param_defaults"]["repetition_penalty"] == chat_params.PLAYGROUND_DEFAULTS["repetition_penalty"]
    for name in ("top_k", "repetition_penalty"):
        assert f'id="p-{name}"' in html and f'id="s-{name}"' in html
