"""What several stage families share, one concept per module.

The families (``control``, ``filter``, ``generate``, ``replay``, ``update``) are peers: a stage
imports from this package, the records, the registry and the shared infrastructure beside it,
never from another family (the import-linter ``independence`` contract in ``pyproject.toml``).
A helper moves here once a second family needs it, or when several stages of one family share
something no family owns (seeds, epochs over the pool); a model of one family's own, such as
``control.success_predictor``, stays in that family.

==================  ==================================================  =====================================
module              what                                                shared by
==================  ==================================================  =====================================
``prompt_stats``    a group's observation of its prompt, Beta updates,  control selectors,
                    ``PromptStats`` as checkpointable data              ``filter.beta_difficulty``
``passk_bins``      GDRO's windowed pass@k bins with hysteresis         ``control.gdro_rollout``,
                                                                        ``filter.gdro_weights``
``epochs``          a seeded permutation per epoch, where a batch       the control selectors
                    starts (``epoch_order``, ``start_batch``)
``seeds``           ``step_seed``: a 31-bit seed from named parts       ``generate.sample`` / ``tree``,
                                                                        ``control.dots`` / ``sgpo``
``run_context``     a selector's step, seed, policy version, policy     the control selectors
                    and engine (``RunContext``)
``fingerprints``    a rollout or prompt as the policy's layer-wise      ``filter.meds``, ``control.dots``,
                    hidden states                                       ``early_exit``, ``gps``, ``depo``
``embedding``       the offline sentence-transformers text embedder     ``replay.store``,
                                                                        ``filter.uniqueness``
``stored``          ``StoredRollout``: a rollout kept for a later step  replay, ``control.pilot_commit``
``store_files``     stored rollouts (and prompts) as parquet            replay, ``control.pilot_commit``
``reuse``           keeping, reusing and saving rollouts without a      ``replay.rollout_replay`` /
                    store                                               ``correct_cache``,
                                                                        ``control.pilot_commit``
==================  ==================================================  =====================================

Not here, because they are infrastructure every family already shares and no family owns:
``gfcr.stages.engine``, ``resources`` (``Lent``: what the runtime lends a stage), ``training``
(what an update and the runtime's trainer exchange), ``data`` (the
sources) and ``verifiers``. Scoring a text with its verifier (``score_text``, ``score_rollout``)
is ``gfcr.stages.verifiers.scoring``: it is the verifier package's own operation (its worker
pool, its registry, its ``Score``), used by ``filter.verify``, by stages that roll out on their
own (``control.dots``, ``control.sgpo``) and by the runtime's evaluation, which is no stage.
A pipeline problem a stage reports from ``check_pipeline`` is ``gfcr.registry.PipelineProblem``.
"""
