"""What hlomap shows a person: rich tables, progress bars, convergence plots and Gantt charts,
one module per thing reported (`estimate`, `sharding`, `pipeline`, `joint`, `placement`,
`replan`, `run`, `inspect`, `zoo`, `simulate`, `explain`), over the plain data the library
returns. Only this package and `hlomap.cli` print. It re-exports nothing: each module is imported
on its own, so a command pays only for the plotting or table code it uses."""
