import pytest
import torch

from ascend_adapters.common.remap import RemapError, Remapper, prefix, rename, skip


def make(targets):
    rules = [
        skip(r"^rot\.weight$", "MTP-only rotation"),
        prefix("blocks.", "model.layers."),
        rename(r"\.att\.receptance\.", ".attn.r_proj."),
        rename(r"\.att\.w1$", ".attn.w_lora.lora.0.weight", transform="transpose"),
        rename(r"\.att\.w0$", ".attn.w_lora.lora.2.bias", transform="squeeze"),
    ]
    return Remapper(rules, targets=targets, source="test.pth")


def test_chain_transform_and_skip():
    targets = {
        "model.layers.0.attn.r_proj.weight",
        "model.layers.0.attn.w_lora.lora.0.weight",
        "model.layers.0.attn.w_lora.lora.2.bias",
        "model.layers.0.never_loaded",
    }
    r = make(targets)
    src = {
        "blocks.0.att.receptance.weight": torch.zeros(4, 4),
        "blocks.0.att.w1": torch.arange(6.0).reshape(2, 3),
        "blocks.0.att.w0": torch.ones(1, 1, 3),
        "rot.weight": torch.zeros(2),
    }
    out = dict(r.apply(src.items()))
    report = r.finish(required=targets)
    assert set(out) == targets - {"model.layers.0.never_loaded"}
    assert out["model.layers.0.attn.w_lora.lora.0.weight"].shape == (3, 2)
    assert torch.equal(out["model.layers.0.attn.w_lora.lora.0.weight"], src["blocks.0.att.w1"].t())
    assert out["model.layers.0.attn.w_lora.lora.2.bias"].shape == (3,)
    assert report.skipped == {"rot.weight": "MTP-only rotation"}
    assert report.unused == ["model.layers.0.never_loaded"]


def test_unknown_names_are_errors_listing_every_culprit():
    r = make({"model.layers.0.attn.r_proj.weight"})
    src = {
        "blocks.0.att.receptance.weight": torch.zeros(1),
        "blocks.0.att.mystery": torch.zeros(1),
        "head.bogus": torch.zeros(1),
    }
    list(r.apply(src.items()))
    with pytest.raises(RemapError) as exc:
        r.finish()
    msg = str(exc.value)
    assert "blocks.0.att.mystery" in msg and "head.bogus" in msg and "test.pth" in msg


def test_rule_validation():
    with pytest.raises(ValueError, match="needs a reason"):
        skip("x", "")
    with pytest.raises(ValueError, match="unknown transform"):
        rename("a", "b", transform="rotate")


def test_callable_targets():
    r = Remapper([prefix("a.", "b.")], targets=lambda n: n.startswith("b."))
    assert r.map_name("a.x")[0] == "b.x"
    assert r.map_name("c.x")[0] is None
    assert r.report.unmapped == {"c.x": "c.x"}
