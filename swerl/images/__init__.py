"""Getting a dataset's task images onto the exec nodes (`swerl images pull` / `status`)."""
