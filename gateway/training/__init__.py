"""Dialect-neutral training services: the domain operations every API dialect (Tinker,
upstream Twinkle's native protocol, OpenAI) performs, written once.

    runs.py         open a run under quotas; LoraSpec <-> run row
    checkpoints.py  reserve -> write -> commit/release -> usage -> checkpoint row
    metering.py     training-token metering; the sampling admission (slot + meter + ledger)
    queries.py      list / get runs and checkpoints
    sampling.py     wire stop -> SamplingParams, with the EOS rule named

No routers and no wire schemas here, and no import of any dialect package (.importlinter).
"""
