"""The command line: recipes (`recipe`), launching ranks through torchrun (`launch`, `torchrun`), the verbs' own
flags and the one tyro call that reads them with a recipe's overrides (`flags`), and the verbs of
`python -m shardlab` (`main`)."""
