"""Width policies: which source drafts each cycle and how many rows the target verifies."""
