"""`specchat profile` (what this machine has) and `specchat plan` (how a pair would run on it)."""

from __future__ import annotations

import argparse
import json
import re

from ..core.errors import InputError
from ..core.files import human_size

CONTEXT = re.compile(r"(\d+)([kKmM]?)")
MARKDOWN_SPECIAL = re.compile(r"[\\*_|<\[\]]")
CODE_SPAN = re.compile(r"(`[^`]*`)")


def add_parsers(commands, add_models_file_option) -> None:
    """Add `profile` and `plan` to the CLI's subparsers."""
    profile = commands.add_parser("profile", help="this machine's GPUs, CPU, RAM and measured bandwidths (cached)")
    profile.add_argument("--json", action="store_true", help="print one JSON object")
    profile.add_argument("--refresh", action="store_true", help="measure again instead of reading the cache")

    plan = commands.add_parser("plan", help="how a model pair would run here: weights, caches, speculation, memory")
    plan.add_argument("--pair", required=True, help="a pair id from `specchat models list`")
    plan.add_argument("--context", required=True, metavar="N",
                      help="tokens of prompt and answer: 32768, 32K or 128K")
    plan.add_argument("--profile", metavar="FILE",
                      help="plan for a saved or synthetic profile (`specchat profile --json`) instead of this machine")
    plan.add_argument("--precision", metavar="exact|auto", default=argparse.SUPPRESS,
                      help="auto (default): the fastest placement, 4-bit weights and an 8-bit KV included; exact: "
                           "the model's own weights and KV dtype, quantized only where nothing else fits "
                           "(default: $SPECCHAT_PRECISION, else auto)")
    plan.add_argument("--json", action="store_true", help="print one JSON object")
    add_models_file_option(plan)


def parse_context(text: str) -> int:
    """32768, 32K or 32k (K = 1,024 tokens), 1M; InputError otherwise."""
    found = CONTEXT.fullmatch(text.strip())
    if not found or int(found.group(1)) == 0:
        raise InputError(f"--context {text!r}: give a positive number of tokens such as 32768, 32K or 128K")
    return int(found.group(1)) * {"": 1, "k": 1024, "m": 1024**2}[found.group(2).lower()]


def run_profile(args) -> int:
    from ..core.hardware import load_or_probe

    profile = load_or_probe(refresh=args.refresh)
    if args.json:
        print(profile.to_json())
        return 0
    for line in profile_lines(profile):
        print(line)
    return 0


def profile_facts(profile) -> list[tuple[str, str]]:
    """(label, text) for each line of the profile: CPU, RAM, torch, the GPUs, the CPU's linear path.
    `specchat profile` prints them as text with the t(n) curves, the app's Models & hardware tab as
    Markdown with the speeds in words."""
    facts = [("CPU", f"{profile.cpu.model}: {profile.cpu.logical_cores} logical cores"
              + (f", {profile.cpu.physical_cores} physical" if profile.cpu.physical_cores else "")),
             ("RAM", f"{human_size(profile.ram_total_bytes)} ({human_size(profile.ram_available_bytes)} available)"),
             ("torch", profile.torch_version + (f", CUDA {profile.cuda_version}" if profile.cuda_version else ", no CUDA"))]
    if not profile.gpus:
        facts.append(("GPU", "none: models run on the CPU"))
    from ..core.hardware import vram_limit_bytes

    limit = vram_limit_bytes()
    if profile.gpus and limit is not None:
        facts.append(("limit", f"at most {human_size(limit)} of each GPU (--vram-limit or $SPECCHAT_VRAM_LIMIT): "
                               f"the plan and the allocator keep to it"))
    for gpu in profile.gpus:
        rates = ", ".join(f"{label} {human_size(rate)}/s" for label, rate in (
            ("host->GPU", gpu.host_to_device_bytes_per_s), ("GPU->host", gpu.device_to_host_bytes_per_s),
            ("on-GPU copy", gpu.memory_bytes_per_s)) if rate) or "bandwidth not measured"
        facts.append((f"GPU {gpu.index}", (f"{gpu.name}: {human_size(gpu.vram_total_bytes)} "
                                           f"({human_size(gpu.vram_free_bytes)} free), compute "
                                           f"{gpu.compute_capability[0]}.{gpu.compute_capability[1]}, "
                                           f"bf16 {'yes' if gpu.bf16 else 'no'}; {rates}")))
    return facts + cpu_linear_facts(profile)


def curve_facts(profile) -> list[tuple[str, str]]:
    """Every measured t(n) curve, as `specchat profile` prints it."""
    facts = []
    for curves in profile.curves:
        for times in curves.times:
            points = ", ".join(f"t({n})={ratio:.2f}" for n, ratio in zip(times.sizes, times.ratios))
            facts.append(("t(n)", (f"{curves.model_key} at {times.context:,} context on {times.device}: "
                                   f"{times.one_token_seconds * 1e3:.1f} ms per token; {points}")))
    return facts


def speed_facts(profile) -> list[tuple[str, str]]:
    """The speeds measured with this version's kernels, in words: one line per model and weights."""
    from ..core.hardware import FORWARD_KERNELS

    facts = []
    for curves in profile.curves:
        if not curves.times or not curves.model_key.endswith(f"#k{FORWARD_KERNELS}"):
            continue  # measured with other kernels: not what the plan goes by
        repo, _, rest = curves.model_key.partition("@")
        weights = rest.partition(":")[2].partition("#")[0]
        per_token = sorted(times.one_token_seconds * 1e3 for times in curves.times)
        contexts = sorted(times.context for times in curves.times)
        largest = max(curves.times[0].sizes)
        checks = sorted(times.ratios[times.sizes.index(largest)] for times in curves.times if largest in times.sizes)
        text = (f"{repo.rstrip('/').rpartition('/')[2]} ({weights}): {_span(per_token, '.0f')} ms per token at "
                f"{_span(contexts, ',')} tokens of context")
        if largest > 1 and checks:  # a forward of `largest` tokens: the last committed one and the drafts
            text += (f"; checking {largest - 1} drafted tokens at once takes as long as "
                     f"{_span(checks, '.1f')} one-token steps")
        facts.append(("speed", text))
    return facts


def _span(values: list[float], spec: str) -> str:
    low, high = format(values[0], spec), format(values[-1], spec)
    return low if low == high else f"{low}-{high}"


def cpu_linear_facts(profile) -> list[tuple[str, str]]:
    """The few-row CPU linear path chosen for each model measured on this machine (issue 42), or
    when it was never measured, what a CPU-only machine will use until it is."""
    from ..core.hardware import cache_dir
    from ..core.cpu_linear import FEW_ROWS
    from ..core.linear_choice import saved_choices

    facts = [("CPU linear", f"{choice.model}: {choice.describe()}, measured {choice.measured_on}")
             for choice in saved_choices(cache_dir() / profile.machine_key())]
    if not facts and not profile.gpus:
        facts.append(("CPU linear", f"F.linear for 1-{FEW_ROWS} rows until measured, when a model first loads on this CPU"))
    return facts


def measured_note(profile) -> str:
    return f"measured {profile.measured_on}, machine key {profile.machine_key()}"


def profile_lines(profile) -> list[str]:
    return [f"{label:5} {text}" for label, text in profile_facts(profile) + curve_facts(profile)] + [
        measured_note(profile)]


def profile_markdown(profile) -> str:
    """The app's words for the profile: each model's measured speed rather than its curves."""
    facts = profile_facts(profile) + speed_facts(profile)
    return "\n".join([f"- **{label}** {_escaped(text)}" for label, text in facts]
                     + ["", f"*{measured_note(profile)}*"])


def run_plan(args) -> int:
    from ..core.hardware import HardwareProfile, capped, load_or_probe, vram_limit_bytes
    from ..core.planning import Overrides, PlanRefused, make_plan, precision_setting
    from ..core.registry import load_registry

    context = parse_context(args.context)
    overrides = Overrides(precision=precision_setting(getattr(args, "precision", None)))
    registry = load_registry(getattr(args, "models_file", None))
    pair = registry.get(args.pair)
    if args.profile:
        try:
            profile = capped(HardwareProfile.load(args.profile), vram_limit_bytes())
        except ValueError as error:
            raise InputError(f"--profile {error}") from None
    else:
        profile = load_or_probe()
    try:
        plan = make_plan(profile, pair, context, overrides, registry=registry)
    except PlanRefused as refusal:
        if not args.json:
            raise
        print(json.dumps({"pair_id": pair.id, "context": context, "refused": str(refusal),
                          "alternatives": [vars(alternative) for alternative in refusal.alternatives]}, indent=1))
        return 2
    if args.json:
        print(json.dumps(plan.to_dict(), indent=1))
        return 0
    for line in plan_lines(plan):
        print(line)
    return 0


def plan_headline(plan) -> str:
    """One line: the pair and context, the mode and its speculation, where weights, draft and KV go
    (DSI: a whole target on each of its GPUs, each instance with a KV of its own)."""
    draft = f"{plan.draft_weights} on {plan.draft_device}" if plan.draft_device else "none"
    instances = f"{len(plan.dsi_devices)} instances" if plan.dsi_devices else "CPU worker processes"
    speculation = {"chain": f"gamma {plan.gamma1}", "tree": f"tree n={plan.tree_size}, d={plan.tree_depth}",
                   "triforce": (f"gamma1 {plan.gamma1}, " if plan.gamma1 else "") + f"gamma2 {plan.gamma2}",
                   "dsi": (f"lookahead {plan.dsi_lookahead}" if plan.dsi_lookahead else "lookahead as measured")
                   + f", {instances}",
                   "plain": "no drafts"}[plan.mode]
    targets = f"each of {', '.join(plan.dsi_devices)}" if plan.dsi_devices else "+".join(plan.target_devices)
    kv = "each instance's GPU" if plan.dsi_devices and plan.kv_device != "cpu-pinned" else plan.kv_device
    if plan.kv_resident_layers:
        kv = f"{plan.resident_words()}, the rest on {plan.kv_device}"
    bits = " in 8 bits" if plan.kv_dtype == "int8" else ""
    return (f"{plan.pair_id} at {plan.context:,} tokens: {plan.mode} ({speculation}), {plan.weights} weights "
            f"on {targets}, draft {draft}, full KV on {kv}{bits}")


def prediction_line(plan) -> str:
    """What the user will feel: decode speed at this context (and plain decoding's, of the same
    weights), the time to read a prompt filling it and to answer."""
    from ..core.planning import answer_tokens, time_to_answer
    from ..core.planning.precision import speed

    if plan.predicted_tokens_per_second is None or plan.predicted_prefill_seconds is None:
        return ("predicted: no figures on a CPU (the cost model needs a GPU's bandwidths)" if plan.target_devices ==
                ("cpu",) else "predicted: no figures until the GPU's bandwidths are measured (`specchat profile --refresh`)")
    answer = answer_tokens(plan.context)
    plain = f"; plain decoding of these weights {speed(plan.plain_tokens_per_second)}" \
        if plan.plain_tokens_per_second else ""
    return (f"predicted: {speed(plan.predicted_tokens_per_second)} at this context{plain}; a "
            f"{plan.context - answer:,}-token prompt read in {_duration(plan.predicted_prefill_seconds)}, a "
            f"{answer}-token answer after {_duration(time_to_answer(plan))} in all")


def _duration(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds < 10 else f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def memory_rows(plan) -> list[tuple[str, str, int, str]]:
    """(what, where, bytes, budget) device by device: its items, then its total, whose budget
    says the device's capacity, the margin kept free and the headroom left (items have none)."""
    rows = []
    for device in plan.devices:
        items = [item for item in plan.memory if item.where == device.device]
        if not items:
            continue
        rows += [(item.what, item.where, item.bytes, "") for item in items]
        budget = (f"of {human_size(device.capacity_bytes)}, margin {human_size(device.margin_bytes)} kept free, "
                  f"headroom {human_size(device.headroom_bytes)}")
        rows.append((f"total on {device.device}", device.device, device.used_bytes, budget))
    return rows


def plan_lines(plan) -> list[str]:
    """The plan for people: the prediction and what the answers are, the choices with their
    reasons, then the memory table."""
    lines = [plan_headline(plan), prediction_line(plan), plan.reasons["answers"], ""]
    reasons = {choice: reason for choice, reason in plan.reasons.items() if choice != "answers"}  # said above
    width = max(map(len, reasons))
    lines += [f"  {choice.ljust(width)}  {reason}" for choice, reason in reasons.items()]
    lines += ["", "  MEMORY"]
    what_width = max(len(item.what) for item in plan.memory)
    lines += [f"  {what.ljust(what_width)}  {where:7} {human_size(size):>9}" + (f"  {budget}" if budget else "")
              for what, where, size, budget in memory_rows(plan)]
    return lines


def plan_markdown(plan) -> str:
    """The plan as `plan_lines` says it, in Markdown: the headline, the prediction, a table of the
    choices with their reasons (what the answers are among them), a table of the memory."""
    lines = [f"**{_escaped(plan_headline(plan))}**", "", _escaped(prediction_line(plan)), "",
             "| Choice | Why |", "|---|---|"]
    lines += [f"| {_escaped(choice)} | {_escaped(reason)} |" for choice, reason in plan.reasons.items()]
    lines += ["", "| Memory | Where | Size | Budget |", "|---|---|--:|---|"]
    for what, where, size, budget in memory_rows(plan):
        bold = "**" if budget else ""  # a device's total
        lines.append(f"| {bold}{_escaped(what)}{bold} | {where} | {bold}{human_size(size)}{bold} | {budget} |")
    return "\n".join(lines)


def _escaped(text: str) -> str:
    """`text` shown literally in Markdown, also inside a table cell; its `code spans` (commands
    in the reasons) stay code."""
    parts = CODE_SPAN.split(text)  # odd indexes: code spans, where only a table's | needs escaping
    return "".join(part.replace("|", "\\|") if index % 2 else MARKDOWN_SPECIAL.sub(r"\\\g<0>", part)
                   for index, part in enumerate(parts))
