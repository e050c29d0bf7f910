"""The kernel configs (w4a4_book/configs.py, chapter nbs/12a_configs.ipynb): every field is a problem field or a tuning
field, `bind` fills the problem and refuses a conflict by name, the registry's defaults are tuning alone, and every
recorded config reads back."""
import ast
import json
import re
from dataclasses import fields

import pytest
import torch

from w4a4_book import configs, records, registry
from w4a4_book.operands import Problem

SPECS = list(registry.REGISTRY.values())
SCALES = {"int4": torch.float16, "int4_pg": torch.uint8, "nvfp4": torch.float8_e4m3fn}


def _problem(spec, M=4352, R=32, out=torch.bfloat16):
    return Problem(M, 3072, 3840, R, scale_dtype=SCALES[spec.fmt], lora_dtype=out, out_dtype=out, fmt=spec.fmt)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.config.__name__)
def test_fields_are_problem_or_tuning(spec):
    c = spec.config()
    assert isinstance(c, configs.KernelConfig)
    assert set(c.problem_fields) <= {f.name for f in fields(c)}
    assert sorted([*c.problem, *c.tuning]) == sorted(f.name for f in fields(c))
    assert not set(c.problem) & set(c.tuning)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.config.__name__)
def test_bind_sets_the_problem_and_keeps_the_tuning(spec):
    c, p = spec.config(), _problem(spec, R=0 if spec.arch == "sm_100a" else 32)
    bound = c.bind(p)
    assert bound.problem == dict(lora_rank=p.R, out_dtype="bfloat16", lora_dtype="bfloat16",
                                 scale_dtype=str(p.scale_dtype).removeprefix("torch."))
    assert bound.tuning == c.tuning and type(c)(**bound.tuning) == c
    assert bound.bind(p) == bound                                    # binding twice to the same problem: the same


@pytest.mark.parametrize("name,value", [("lora_rank", 64), ("out_dtype", "float16"), ("lora_dtype", "float16")])
def test_bind_refuses_a_problem_field_set_otherwise_by_name(name, value):
    with pytest.raises(ValueError, match=rf"^config\.{name}: is {value!r}, but the operands give"):
        configs.HopperV2Config(**{name: value}).bind(Problem(8, 256, 256, 32))


@pytest.mark.parametrize("arch,fmt", sorted({(s.arch, s.fmt) for s in SPECS}))
def test_registry_defaults_are_tuning_alone(arch, fmt):
    "A default config, alone or with a problem's tile, keeps every problem field at its default."
    spec = registry.find_kernel(None, fmt, arch)
    problems = [None] + [_problem(spec, M, R, out) for M in (256, 1024, 4352) for R in (0, 32, 128)
                         for out in (torch.bfloat16, torch.float16)]
    for p in problems:
        cfg = registry.default_config(fmt, arch, p)
        assert cfg.problem == type(cfg)().problem, (p, cfg)


def _recorded_configs():
    "Every config `repr` the records hold, with its record's name."
    for path in sorted(records.data_dir().glob("*.json")):
        for m in re.finditer(r'"config": "(\w+Config\([^"]*\))"', path.read_text()):
            yield path.name, json.loads(f'"{m.group(1)}"')


def test_recorded_configs_read_back_as_tuning():
    """A recorded config, written with today's fields of a registered kernel's config, rebuilds from its repr as the
    same string, its problem unbound (a record of a retired kernel or field is left as it was measured)."""
    classes = {s.config.__name__: s.config for s in SPECS}
    seen = 0
    for name, text in _recorded_configs():
        call = ast.parse(text, mode="eval").body
        cls, named = classes.get(call.func.id), {k.arg: ast.literal_eval(k.value) for k in call.keywords}
        if cls is None or list(named) != [f.name for f in fields(cls)]:
            continue
        cfg = cls(**named)
        assert repr(cfg) == text and cfg.problem == cls().problem, name
        seen += 1
    assert seen > 0
