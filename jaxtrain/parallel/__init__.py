from jaxtrain.parallel.mesh import DATA_AXES, RULES, make_mesh, batch_sharding, logical_shardings
