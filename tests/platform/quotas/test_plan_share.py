"""A plan's fair share: validated in the admin and the model, carried on every engine request as the
user's weight with the user as tenant."""

import pytest
from django.contrib.auth import get_user_model
from django.core.exceptions import ValidationError

from generation import services as generation
from generation.services import Generation
from inference import protocol
from quotas.models import Plan, UserPlan

pytestmark = pytest.mark.django_db

PLAN_FORM = {"name": "shared", "allowed_models": "[]"}


@pytest.mark.parametrize("bad", ["0", "-1", "abc", "nan", "inf", ""])
def test_a_bad_share_is_a_validation_error_in_the_admin(admin_client, bad):
    response = admin_client.post("/admin/quotas/plan/add/", {**PLAN_FORM, "share": bad})
    assert response.status_code == 200  # the form again, with the error
    assert "share" in response.context["adminform"].form.errors
    assert not Plan.objects.filter(name="shared").exists()


def test_a_good_share_is_saved_from_the_admin(admin_client):
    response = admin_client.post("/admin/quotas/plan/add/", {**PLAN_FORM, "share": "2.5"})
    assert response.status_code == 302
    assert Plan.objects.get(name="shared").share == 2.5


@pytest.mark.parametrize("bad", [0, -3.0, float("nan"), float("inf")])
def test_full_clean_refuses_a_non_positive_share(bad):
    with pytest.raises(ValidationError, match="share must be a positive number"):
        Plan(name="p", share=bad).full_clean()


def test_engine_requests_carry_the_user_as_tenant_and_the_plan_share_as_weight(isolated_quota_prefix):
    user = get_user_model().objects.create_user("share-user", password="pw-123456!")
    UserPlan.objects.create(user=user, plan=Plan.objects.create(name="gold", share=3.0))
    gen = Generation(
        source="api",
        endpoint="/v1/completions",
        user=user,
        model="m",
        prompts=[[1, 2]],
        sampling_params={"max_tokens": 4},
        request_id="cmpl-share",
    )
    generation.admit(gen)
    [request] = generation._engine_requests(gen)
    built = protocol.EngineRequest.build(**request)
    assert (built.tenant, built.weight) == (str(user.pk), 3.0)
