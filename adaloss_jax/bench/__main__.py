"""``python -m adaloss_jax.bench``."""

from adaloss_jax.bench._cli import main

raise SystemExit(main())
