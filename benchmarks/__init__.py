"""The benchmarks behind `specchat bench --suite X`: the CLI imports them, core never does."""
