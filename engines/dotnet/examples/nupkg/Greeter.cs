// A library the example worker depends on: shipped beside it in the nupkg's lib/<tfm>/.
namespace Examples.Greeting
{
    public static class Greeter
    {
        public static string Greet(string name) { return "Hello, " + name + "!"; }
    }
}
