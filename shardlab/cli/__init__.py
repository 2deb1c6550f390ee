"""The command line: recipes (`recipe`), launching ranks through torchrun (`launch`, `torchrun`), and the verbs of
`python -m shardlab` (`main`)."""
