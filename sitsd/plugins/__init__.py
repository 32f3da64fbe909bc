"""Bundled plugins (found by name through `sitsd.engine.tiers.load_batch_controller`)."""
