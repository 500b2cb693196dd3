"""The plan is the engine's configuration: every field of a `Plan` reaches the engine, through
`settings_from_plan` (runtime.py) or the load options (placement.py)."""

from dataclasses import fields, replace

import pytest

from test_plan import PROFILES, REGISTRY
from specchat.core.decoding import TriforceSettings
from specchat.core.placement import draft_options, target_options
from specchat.core.planning import Plan, make_plan
from specchat.core.runtime import settings_from_plan

K = 1024
REPORT_ONLY = {"pair_id", "memory", "devices", "reasons",  # shown by `specchat plan` and the Models tab
               "precision", "predicted_tokens_per_second", "plain_tokens_per_second", "predicted_prefill_seconds",
               "exact_tokens_per_second"}
OTHER = {  # a different valid value for each field, given the plan's own
    "context": lambda v: v // 2,
    "mode": lambda v: "chain" if v != "chain" else "triforce",
    "weights": lambda v: "nf4" if v != "nf4" else "bfloat16",
    "target_devices": lambda v: ("cuda:0", "cuda:1") if len(v) == 1 else ("cuda:0",),
    "target_layers": lambda v: (v[0] - 1, *v[1:-1], v[-1] + 1) if len(v) > 1 else (v[0] - 1, 1),
    "draft_device": lambda v: None if v else "cuda:0",
    "draft_weights": lambda v: "float32" if v != "float32" else "bfloat16",
    "kv_device": lambda v: "cpu-pinned" if v != "cpu-pinned" else "cuda:0",
    "triforce_verify": lambda v: "tree" if v != "tree" else "chain",
    "dsi_devices": lambda v: () if v else ("cuda:0", "cuda:1"),
    "head_weights": lambda v: "nf4" if v != "nf4" else "bfloat16",
    "embedding_device": lambda v: "cpu" if v != "cpu" else "cuda:0",
    "kv_dtype": lambda v: "int8" if v != "int8" else "bfloat16",
}


def engine_view(plan: Plan, spec):
    return settings_from_plan(plan, None, has_draft=True), target_options(plan, spec), draft_options(plan)


def other_value(name, value):
    if name in OTHER:
        return OTHER[name](value)
    return 2 * value + 1 if isinstance(value, int) else 3  # counts and sizes; None -> a number


PLANS = [("rtx3060-12gb", "llama3.1-8b", 128 * K), ("rtx4060ti-8gb-32gb", "llama3.1-8b", 128 * K), ("rtx4090-24gb", "qwen2.5-7b", 32 * K),
         ("2x-rtx4090", "llama3.1-8b", 128 * K), ("cpu-only-32gb", "embedded", 8 * K),
         ("2x-rtx4090", "qwen2.5-7b", 8 * K)]  # the last: DSI over both cards


@pytest.mark.parametrize("name", [f.name for f in fields(Plan) if f.name not in REPORT_ONLY])
def test_every_plan_field_reaches_the_engine(name):
    changed = []
    for profile, pair_id, context in PLANS:
        pair = REGISTRY.get(pair_id)
        plan = make_plan(PROFILES[profile], pair, context, registry=REGISTRY)
        altered = replace(plan, **{name: other_value(name, getattr(plan, name))})
        changed.append(engine_view(altered, pair.target) != engine_view(plan, pair.target))
    assert any(changed), f"Plan.{name} changes nothing the engine runs by"


def test_the_report_fields_are_the_only_exceptions():
    assert REPORT_ONLY < {f.name for f in fields(Plan)}


def test_a_dsi_plan_gives_the_engine_its_devices_and_lookahead():
    profile, pair_id, context = PLANS[-1]
    plan = make_plan(PROFILES[profile], REGISTRY.get(pair_id), context)
    assert plan.mode == "dsi"
    settings = settings_from_plan(plan, None, has_draft=True)
    assert settings.auto_mode == "dsi" and settings.dsi_devices == ("cuda:0", "cuda:1")
    assert settings.dsi_lookahead == plan.dsi_lookahead == 8
    assert settings.triforce.gamma1 == TriforceSettings().gamma1  # the lookahead is DSI's alone
