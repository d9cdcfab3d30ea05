"""``hcache check`` (:mod:`.command`): this machine's environment (:mod:`.environment`), its copy and disk
floors (:mod:`.floors`), every restore against recompute (:mod:`.correctness`), and on a GPU the restore
speed against its bounds (:mod:`.speed`)."""
