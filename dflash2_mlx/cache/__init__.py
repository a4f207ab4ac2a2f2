"""Caches: the batch's ragged rows (`batch`), the prompt cache in RAM (`prompt`) and on disk
(`disk`, `disk_file`, `disk_state`).
"""
