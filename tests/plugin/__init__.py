"""Tests of the plugin core: enable(), the cache salt, PrecisionConfig, the workspace planner, the layout rules."""
