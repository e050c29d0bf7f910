"""The kernel configs (w4a4_book/configs.py, chapter nbs/12a_configs.ipynb): a config is tuning alone, the problem
travels beside it and is refused by name where the kernel cannot build it, the registry's defaults solve at their
problem, and every recorded config reads back."""
import ast
import json
import re
from dataclasses import fields

import pytest
import torch

from w4a4_book import configs, records, registry, smem
from w4a4_book.operands import Problem

SPECS = list(registry.REGISTRY.values())
SCALES = {"int4": torch.float16, "int4_pg": torch.uint8, "nvfp4": torch.float8_e4m3fn}
# the problem's fields the configs carried before they held tuning alone, each at the default it was recorded with
RECORDED_PROBLEM = ("lora_rank", "out_dtype", "lora_dtype", "scale_dtype")


def _problem(spec, M=4352, R=32, out=torch.bfloat16):
    return Problem(M, 3072, 3840, R, scale_dtype=SCALES[spec.fmt], lora_dtype=torch.bfloat16, out_dtype=out,
                   fmt=spec.fmt)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.config.__name__)
def test_a_config_is_tuning_alone(spec):
    "No field of a kernel config is one the operands decide, and it names a default for each of the problem's dtypes."
    c = spec.config()
    assert isinstance(c, configs.KernelConfig)
    assert not {f.name for f in fields(c)} & {*RECORDED_PROBLEM, *(f.name for f in fields(smem.ProblemSpec))}
    assert set(c.dtypes) == set(smem.PROBLEM_DTYPES) and all(c.dtypes.values())


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.config.__name__)
def test_the_problem_comes_from_the_operands(spec):
    c, p = spec.config(), _problem(spec, R=0 if spec.arch == "sm_100a" else 32)
    got = smem.problem_of(c, p)
    assert got == smem.ProblemSpec(p.R, p.K, "bfloat16", "bfloat16", str(p.scale_dtype).removeprefix("torch."))
    assert smem.solve(c, p).problem == got == smem.problem_of(c, got)        # an operands' Problem or its spec: one


@pytest.mark.parametrize("field,value", [("out_dtype", torch.float32), ("lora_dtype", torch.float32),
                                         ("scale_dtype", torch.float16)])
def test_a_problem_the_kernel_cannot_build_is_refused_by_name(field, value):
    p = Problem(8, 256, 256, 32, fmt="int4_pg", **{"scale_dtype": torch.uint8, field: value})
    with pytest.raises(ValueError, match=rf"^{field}='{str(value).removeprefix('torch.')}': must be one of"):
        smem.solve(configs.HopperPgConfig(), p)


@pytest.mark.parametrize("arch,fmt", sorted({(s.arch, s.fmt) for s in SPECS}))
def test_registry_defaults_solve_at_their_problem(arch, fmt):
    "A default config, alone or with a problem's tile, solves at that problem (a dtype its kernel takes, any rank)."
    spec = registry.find_kernel(None, fmt, arch)
    for p in [_problem(spec, M, R, out) for M in (256, 1024, 4352) for R in (0, 32, 128)
              for out in (torch.bfloat16, torch.float16)]:
        cfg = registry.default_config(fmt, arch, p)
        assert smem.solve(cfg, p).problem.R == p.R, (p, cfg)


def _recorded_configs():
    "Every config `repr` the records hold, with its record's name."
    for path in sorted(records.data_dir().glob("*.json")):
        for m in re.finditer(r'"config": "(\w+Config\([^"]*\))"', path.read_text()):
            yield path.name, json.loads(f'"{m.group(1)}"')


def test_recorded_configs_read_back_as_tuning():
    """A recorded config of a registered kernel's config rebuilds from its repr as the same string, less the problem
    fields configs carried when it was recorded (always at their defaults: each run's problem is in its row). A
    record of a retired kernel or field is left as it was measured."""
    classes = {s.config.__name__: s.config for s in SPECS}
    seen = 0
    for name, text in _recorded_configs():
        call = ast.parse(text, mode="eval").body
        cls, named = classes.get(call.func.id), {k.arg: ast.literal_eval(k.value) for k in call.keywords}
        then = {k: named.pop(k) for k in RECORDED_PROBLEM if k in named}
        if cls is None or list(named) != [f.name for f in fields(cls)]:
            continue
        assert then.get("lora_rank", 0) == 0, name
        cfg = cls(**named)
        now = text
        for k, v in then.items():
            now = now.replace(f", {k}={v!r}", "")
        assert repr(cfg) == now, name
        seen += 1
    assert seen > 0
