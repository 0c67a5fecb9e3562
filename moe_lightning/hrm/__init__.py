"""The Hierarchical Roofline Model: hardware profiles, the per-layer cost model, the policy search."""
