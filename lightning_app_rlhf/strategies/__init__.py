"""Placement strategies (Flattening, Interleaving, Separation) for Lightning's Trainer and Fabric."""
