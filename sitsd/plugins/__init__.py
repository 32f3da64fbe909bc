"""Bundled plugins and the plugin interface (`interface.py`); plugins are found by name through
`sitsd.engine.tiers.load_batch_controller`."""
