"""Wire formats: each format vmpin writes for another program (or another vmpin process) has
one home here, with its version, its limits and its reader/writer. Pure, stdlib only: the
guest program ships these modules."""
