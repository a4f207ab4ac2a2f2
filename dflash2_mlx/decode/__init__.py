"""The draft-verify loop: the engine, one sequence's record and plan, the decode state
(caches and features), sampling and acceptance, lookup drafting, and a generation's figures.
"""
