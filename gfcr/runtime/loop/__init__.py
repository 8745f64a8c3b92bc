"""The step loop: the local runner (``local``), the Prefect runner built on it
(``prefect_runner``, with ``server_guard`` for the embedded server), a training run bound to its
directory (``session``: ``Run``, ``build_services``) and evaluation (``evaluation``)."""
