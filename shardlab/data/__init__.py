"""Data: where documents come from (`documents`, `datasets`, `chat`, `tokenizer`), how they pack into rows
(`packing`), and the loader that gives each rank its rows of every global batch (`loader`)."""
