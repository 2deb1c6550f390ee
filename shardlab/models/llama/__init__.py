"""shardlab's Llama 3, dense or with MoE layers: the model (`model`, `moe`), its default layout (`rules`), its
Hugging Face names (`hf_names`) and its provider (`provider`)."""
