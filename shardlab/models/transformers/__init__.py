"""transformers causal LMs from a local directory: the provider (`provider`), rules derived from transformers' own TP
plan (`rules`), how the model and its pipeline stages run (`stage`), and its checkpoint names (`names`)."""
