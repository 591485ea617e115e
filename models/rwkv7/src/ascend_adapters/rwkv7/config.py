"""The HF/fla configuration of RWKV-7 (``model_type: rwkv7``) and its limits.

transformers has no RWKV-7 config class, so ``register_config()`` registers
``Rwkv7Config`` with ``AutoConfig`` (only when transformers does not already
know the model type). Field names follow flash-linear-attention's
``RWKV7Config``, which is what HF-layout checkpoints carry.

Epsilons: the ``ln_x`` group norm uses ``eps = head_dim * norm_eps`` (the fla
reading). The official ``rwkv`` package fixes it at 64e-5, so converted
configs carry ``norm_eps = 64e-5 / head_dim``. The layer norms use
``layer_norm_eps`` when the config has it (converted configs: 1e-5, the
``rwkv`` package's value), else ``norm_eps`` (fla's reading).
"""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig

MODEL_TYPE = "rwkv7"
# Head sizes the portable kernels are checked for (released models use 64).
SUPPORTED_HEAD_DIMS = (32, 64, 128)
RWKV_GROUP_NORM_EPS = 64e-5
RWKV_LAYER_NORM_EPS = 1e-5


class Rwkv7ConfigError(ValueError):
    """A config.json (or a checkpoint) this adapter cannot serve; the message names the field or tensor."""


class Rwkv7Config(PretrainedConfig):
    model_type = MODEL_TYPE
    keys_to_ignore_at_inference = ["past_key_values"]
    attribute_map = {"num_attention_heads": "num_heads"}

    def __init__(
        self,
        attn_mode: str = "chunk",
        hidden_size: int = 2048,
        hidden_ratio: float | None = 4,
        intermediate_size: int | None = None,
        num_hidden_layers: int = 24,
        head_dim: int | None = 64,
        num_heads: int | None = None,
        decay_low_rank_dim: int = 64,
        gate_low_rank_dim: int = 128,
        a_low_rank_dim: int = 64,
        v_low_rank_dim: int = 16,
        hidden_act: str = "sqrelu",
        max_position_embeddings: int = 2048,
        norm_first: bool = True,
        norm_bias: bool = True,
        norm_eps: float = 1e-5,
        layer_norm_eps: float | None = None,
        attn: dict | None = None,
        use_cache: bool = True,
        pad_token_id: int | None = None,
        bos_token_id: int = 1,
        eos_token_id: int = 2,
        tie_word_embeddings: bool = False,
        initializer_range: float = 0.02,
        fuse_norm: bool = True,
        fuse_cross_entropy: bool = True,
        vocab_size: int = 32000,
        value_dim: Any = None,
        **kwargs,
    ):
        self.attn_mode = attn_mode
        self.hidden_size = hidden_size
        self.hidden_ratio = hidden_ratio
        if intermediate_size is None:
            intermediate_size = int(hidden_size * (hidden_ratio or 4))
            intermediate_size = 32 * ((intermediate_size + 31) // 32)
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        if head_dim is None and num_heads:
            head_dim = hidden_size // num_heads
        self.head_dim = head_dim
        self.num_heads = num_heads if num_heads else (hidden_size // head_dim if head_dim else None)
        self.decay_low_rank_dim = decay_low_rank_dim
        self.gate_low_rank_dim = gate_low_rank_dim
        self.a_low_rank_dim = a_low_rank_dim
        self.v_low_rank_dim = v_low_rank_dim
        self.hidden_act = hidden_act
        self.max_position_embeddings = max_position_embeddings
        self.norm_first = norm_first
        self.norm_bias = norm_bias
        self.norm_eps = norm_eps
        self.layer_norm_eps = layer_norm_eps
        self.attn = attn
        self.use_cache = use_cache
        self.initializer_range = initializer_range
        self.fuse_norm = fuse_norm
        self.fuse_cross_entropy = fuse_cross_entropy
        self.vocab_size = vocab_size
        self.value_dim = value_dim
        super().__init__(
            pad_token_id=pad_token_id,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            tie_word_embeddings=tie_word_embeddings,
            **kwargs,
        )

    @property
    def group_norm_eps(self) -> float:
        return self.head_dim * self.norm_eps

    @property
    def ln_eps(self) -> float:
        return self.layer_norm_eps if self.layer_norm_eps is not None else self.norm_eps


def register_config() -> None:
    """Register ``Rwkv7Config`` with AutoConfig unless transformers knows ``rwkv7``. Idempotent."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if MODEL_TYPE in CONFIG_MAPPING:
        return
    AutoConfig.register(MODEL_TYPE, Rwkv7Config)


def validate_config(cfg, source: str = "config.json") -> None:
    """Reject configs this adapter cannot serve, naming the field."""

    def err(msg):
        raise Rwkv7ConfigError(f"{source}: {msg}")

    for name in (
        "hidden_size",
        "num_hidden_layers",
        "head_dim",
        "vocab_size",
        "intermediate_size",
        "decay_low_rank_dim",
        "gate_low_rank_dim",
        "a_low_rank_dim",
        "v_low_rank_dim",
    ):
        val = getattr(cfg, name, None)
        if not isinstance(val, int) or val <= 0:
            err(f"field {name!r} must be a positive integer, got {val!r}")
    c, n = cfg.hidden_size, cfg.head_dim
    if n not in SUPPORTED_HEAD_DIMS:
        err(f"head_dim {n} is not supported (supported head sizes: {', '.join(map(str, SUPPORTED_HEAD_DIMS))})")
    if c % n:
        err(f"hidden_size {c} is not a multiple of head_dim {n}")
    if cfg.num_heads not in (None, c // n):
        err(f"num_heads {cfg.num_heads} disagrees with hidden_size / head_dim = {c // n}")
    if getattr(cfg, "attn", None):
        err("hybrid attention layers ('attn' field) are not supported by this adapter")
    if getattr(cfg, "hidden_act", "sqrelu") != "sqrelu":
        err(f"hidden_act {cfg.hidden_act!r} is not supported (RWKV-7 uses 'sqrelu')")
    if not getattr(cfg, "norm_bias", True):
        err("norm_bias false is not supported (RWKV-7 layer norms have biases)")
    vd = getattr(cfg, "value_dim", None)
    if vd is not None:
        vds = vd if isinstance(vd, (list, tuple)) else [vd]
        if any(x != c for x in vds):
            err(f"value_dim {vd!r} differs from hidden_size {c}; only value_dim == hidden_size is supported")
    if getattr(cfg, "tie_word_embeddings", False):
        err("tie_word_embeddings true is not supported (RWKV-7 has a separate head)")


def hf_tensor_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """Every tensor of the HF/fla layout with its shape, for this config."""
    c, h, n = cfg.hidden_size, cfg.hidden_size // cfg.head_dim, cfg.head_dim
    i, v = cfg.intermediate_size, cfg.vocab_size
    ranks = {"w": cfg.decay_low_rank_dim, "a": cfg.a_low_rank_dim, "v": cfg.v_low_rank_dim, "g": cfg.gate_low_rank_dim}
    shapes: dict[str, tuple[int, ...]] = {
        "model.embeddings.weight": (v, c),
        "model.norm.weight": (c,),
        "model.norm.bias": (c,),
        "lm_head.weight": (v, c),
    }
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}."
        norms = ["attn_norm", "ffn_norm"] + (["pre_norm"] if layer == 0 else [])
        for norm in norms:
            shapes[p + norm + ".weight"] = (c,)
            shapes[p + norm + ".bias"] = (c,)
        for x in "rwkvag":
            shapes[p + f"attn.x_{x}"] = (1, 1, c)
        shapes[p + "attn.k_k"] = (c,)
        shapes[p + "attn.k_a"] = (c,)
        shapes[p + "attn.r_k"] = (h, n)
        for proj in ("r_proj", "k_proj", "v_proj", "o_proj"):
            shapes[p + f"attn.{proj}.weight"] = (c, c)
        for lora, rank in ranks.items():
            if lora == "v" and layer == 0:
                continue
            shapes[p + f"attn.{lora}_lora.lora.0.weight"] = (rank, c)
            shapes[p + f"attn.{lora}_lora.lora.2.weight"] = (c, rank)
            if lora != "g":
                shapes[p + f"attn.{lora}_lora.lora.2.bias"] = (c,)
        shapes[p + "attn.g_norm.weight"] = (c,)
        shapes[p + "attn.g_norm.bias"] = (c,)
        shapes[p + "ffn.x_k"] = (c,)
        shapes[p + "ffn.key.weight"] = (i, c)
        shapes[p + "ffn.value.weight"] = (c, i)
    return shapes


def check_shapes(cfg, actual: dict[str, tuple[int, ...]], source: str) -> None:
    """Compare a checkpoint's tensor shapes with what the config implies; one error listing every problem."""
    expected = hf_tensor_shapes(cfg)
    problems = []
    for name, shape in expected.items():
        if name not in actual:
            problems.append(f"missing tensor {name!r} (expected shape {list(shape)})")
        elif tuple(actual[name]) != shape:
            problems.append(f"tensor {name!r} has shape {list(actual[name])}, config implies {list(shape)}")
    for name in sorted(set(actual) - set(expected)):
        problems.append(f"unexpected tensor {name!r} with shape {list(actual[name])}")
    if problems:
        shown = problems[:20] + ([f"... and {len(problems) - 20} more"] if len(problems) > 20 else [])
        raise Rwkv7ConfigError(
            f"{source}: checkpoint and config.json disagree (hidden_size={cfg.hidden_size}, "
            f"num_hidden_layers={cfg.num_hidden_layers}, head_dim={cfg.head_dim}, vocab_size={cfg.vocab_size}, "
            f"intermediate_size={cfg.intermediate_size}):\n  " + "\n  ".join(shown)
        )


def checkpoint_shapes(model_dir) -> dict[str, tuple[int, ...]]:
    """Tensor shapes of every ``*.safetensors`` in a local directory, read from the headers only."""
    from pathlib import Path

    from ascend_adapters.common.admission.safetensors_header import HeaderError, read_tensors

    shapes: dict[str, tuple[int, ...]] = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        try:
            tensors = read_tensors(f)
        except HeaderError as exc:
            raise Rwkv7ConfigError(str(exc)) from None
        shapes.update({name: t.shape for name, t in tensors.items()})
    return shapes


def check_checkpoint_dir(cfg, model_dir) -> None:
    """Validate config.json and compare it with the safetensors headers of a local checkpoint directory."""
    from pathlib import Path

    validate_config(cfg, source=f"{model_dir}/config.json")
    if Path(model_dir).is_dir():
        shapes = checkpoint_shapes(model_dir)
        if shapes:
            check_shapes(cfg, shapes, source=str(model_dir))
