"""autopar.strategies: mesh, layouts, redistribution, cost model and the search modes."""
