"""DeepSeek-V4's lightning indexer (CSA layers): its own overlapping compressor at ``index_head_dim``
(the indexer keys) plus query and weight heads that score every compressed entry per query; the
attention keeps the top-k visible entries."""

from __future__ import annotations

from vllm.model_executor.layers.linear import ReplicatedLinear

from ascend_adapters.deepseek_v4.compressor import DeepseekV4Compressor


class DeepseekV4Indexer(DeepseekV4Compressor):
    """Lightning indexer: its own overlapping compressor at index_head_dim plus query/weight heads."""

    def __init__(self, config, rate: int, quant_config, prefix: str):
        super().__init__(config, rate, config.index_head_dim, True, quant_config, prefix)
        self.n_heads, self.topk = config.index_n_heads, config.index_topk
        self.q_b_proj = ReplicatedLinear(
            config.q_lora_rank,
            self.n_heads * self.head_dim,
            bias=False,
            quant_config=quant_config,
            prefix=f"{prefix}.q_b_proj",
            return_bias=False,
        )
        self.weights_proj = ReplicatedLinear(
            config.hidden_size,
            self.n_heads,
            bias=False,
            quant_config=None,
            prefix=f"{prefix}.weights_proj",
            return_bias=False,
        )
        self.softmax_scale = self.head_dim**-0.5
        self.weights_scale = self.n_heads**-0.5
