"""Plain data shared by every layer: configs, the role table, file writes, wrapper names, upstream warnings."""
