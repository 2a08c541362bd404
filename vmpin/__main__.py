from vmpin.entry import console

console()
