"""Developer tooling, not shipped: bootstrap the real parts, run a dev cluster, run the demo."""
