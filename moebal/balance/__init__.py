"""The balancers: observe, plan, apply, at the expert, layer and micro-batch levels."""
