"""gfcr: a declarative pipeline language and runtime for the rollout lifecycle of LLM RL.

The package is layered (DESIGN.md section 5); importing ``gfcr`` itself is cheap and pulls in
no heavy dependency.
"""

__version__ = "0.1.0"
