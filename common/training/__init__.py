"""Distilling a draft model from its target: data from the target's own generations, training of the
draft layers and its Markov head, and acceptance measurement (see `specsplit train-draft`)."""
