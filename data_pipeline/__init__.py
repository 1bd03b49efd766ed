"""Everything before the first step: curation, tokenizers, indexed shards, samples, blending, loaders."""
