"""Speculative decoding in the worker: proposers guess each decoding request's next tokens
(proposer.py: the contract; ngram.py, draft_model.py, eagle.py), the target model verifies them
in the step's one forward, and the rejection sampler (rejection_sampler.py) keeps exactly what
the target would have sampled. The engine core schedules the drafts (engine_core/scheduler.py)."""
